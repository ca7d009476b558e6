/* GGUF blocks on the CPU (cpu_blocks.py builds and loads this file).

   A decode step on the CPU streams every weight once. Kept in its file's blocks, a weight
   is 4.5 to 8.5 bits, not float32's 32. Each block's weights are d * c + m (c its integer
   codes, d and m from its float16 scales), exactly the float32 values gguf's own
   dequantization gives. One row of x sums d * (c . x) + m * sum(x) in float32, which spares
   the scaling of every weight (1.8 times the speed of d * c + m first, one CPU core); more
   rows share each unit's weights d * c + m, dequantized once in registers for a tile of
   rows. The vectors are GCC's vector extensions, so the compiler picks the instructions of
   the machine it builds on (-march=native); a byte goes to float through int32 because GCC
   scalarises the direct conversion (and, on AVX2 without AVX-512, by intrinsics).

   Block layouts (ggml's): Q4_0 {d; qs[16]}, Q4_1 {d; m; qs[16]}, Q5_0 {d; qh[4]; qs[16]},
   Q5_1 {d; m; qh[4]; qs[16]}, Q8_0 {d; qs[32] int8}: element j < 16 of a block is the low
   nibble of qs[j], element j + 16 its high nibble, Q5's fifth bits bit j of qh. Q4_K {d;
   dmin; scales[12]; qs[128]}, Q5_K {d; dmin; scales[12]; qh[32]; qs[128]}, Q6_K {ql[128];
   qh[64]; scales[16] int8; d} hold 256 elements (decode says where each unit's are). */

#include <stdint.h>
#include <stdlib.h>

#include "cpu_vectors.h"

#if defined(__AVX2__) && VW == 8   /* AVX2's intrinsics serve the 8-lane build */
#define AVX2_ONLY 1
#include <immintrin.h>
#else
#define AVX2_ONLY 0
#endif

typedef uint8_t v16b __attribute__((vector_size(16)));

#define PARTS (16 / VW)   /* vectors in half a unit (16 codes) */

/* 16 bytes as floats less offset, in PARTS vectors; a byte goes to float through int32
   because GCC scalarises the direct conversion */
static inline void floats_of(v16b bytes, float offset, vf out[PARTS]) {
    for (int p = 0; p < PARTS; p++) {
        uint8_t part[VW];
        memcpy(part, (const uint8_t *)&bytes + VW * p, VW);
#if AVX2_ONLY   /* GCC 12 lowers the generic conversion to one extraction a byte */
        const __m128i b = _mm_loadl_epi64((const __m128i *)part);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        memcpy(&out[p], &f, sizeof f);
#else
        typedef uint8_t vb __attribute__((vector_size(VW)));
        vb q;
        memcpy(&q, part, VW);
        out[p] = __builtin_convertvector(__builtin_convertvector(q, vi), vf);
#endif
        out[p] -= offset;
    }
}

/* Bytes ahead of the row being read that each thread asks the caches for: read from memory
   without it, the 121 matrices of the default model's step took 22 ms at one row on the
   2-core machine; 12-13 ms with 1 to 16 KB (2 KB best). */
#define PREFETCH 2048

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };   /* ggml's type ids */

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

/* A unit is 32 elements of a block (a simple format's whole block, an eighth of a
   K-quant's 256). Its codes c come as two halves of 16 (elements 0-15 in lo, 16-31 in hi,
   PARTS vectors each; codes), its scales and offsets once a block for all its units
   (scales): each weight d * c + m as gguf's dequantization computes it (d * c exact in
   float32 where gguf adds an offset, one rounding either way). The simple formats and
   Q4_K/Q5_K have one scale a unit, Q6_K one a half (d[2 * s] and d[2 * s + 1]); Q6_K's and
   the simple formats' offsets but Q4_1's and Q5_1's are 0. */
typedef struct {
    float d[16], m[8];
} block_scales;

/* Q4_K's and Q5_K's six-bit scale and minimum of sub-block s (ggml's get_scale_min_k4) */
static inline void scale_min(const uint8_t *scales, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = scales[s] & 63, *mn = scales[s + 4] & 63;
    } else {
        *sc = (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4);
        *mn = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
    }
}

static inline void scales(int format, const uint8_t *b, block_scales *out) {
    int sc, mn;
    switch (format) {
    case Q4_1: case Q5_1:
        out->d[0] = half(b), out->m[0] = half(b + 2);
        return;
    case Q4_K: case Q5_K: {
        const float d = half(b), dmin = half(b + 2);
        for (int s = 0; s < 8; s++) {
            scale_min(b + 4, s, &sc, &mn);
            out->d[s] = d * (float)sc, out->m[s] = -(dmin * (float)mn);
        }
        return;
    }
    case Q6_K: {
        const float d = half(b + 208);
        for (int i = 0; i < 16; i++) out->d[i] = d * (float)((const int8_t *)(b + 192))[i];
        return;
    }
    default:   /* Q4_0, Q5_0, Q8_0 */
        out->d[0] = half(b), out->m[0] = 0.0f;
    }
}

/* Q5's fifth bits of VW elements (bit first + j of qh's four bytes for element j), as 0 or
   16 (shifted in int32 lanes: as bytes OR'd into the codes, AVX-512's Q5 products took 1.75
   times as long) */
static inline vf fifth_bits(const uint8_t *qh, int first) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
#if VW == 16
    const vi at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vi at = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
    const vi word = (vi){0} + (int32_t)(bits >> first);
    return __builtin_convertvector(((word >> at) & 1) << 4, vf);
}

/* Q5's codes: the low four bits from q, the fifth from qh */
static inline void five_bits(v16b q, const uint8_t *qh, float offset, vf lo[PARTS], vf hi[PARTS]) {
    floats_of(q & 15, offset, lo), floats_of(q >> 4, offset, hi);
    for (int p = 0; p < PARTS; p++) lo[p] += fifth_bits(qh, VW * p), hi[p] += fifth_bits(qh, 16 + VW * p);
}

/* unit s's codes c: elements 0-15 in lo, 16-31 in hi */
static inline void codes(int format, const uint8_t *b, int s, vf lo[PARTS], vf hi[PARTS]) {
    v16b q;
    switch (format) {
    case Q4_0:
        q = bytes16(b + 2);
        floats_of(q & 15, 8.0f, lo), floats_of(q >> 4, 8.0f, hi);
        return;
    case Q4_1:
        q = bytes16(b + 4);
        floats_of(q & 15, 0.0f, lo), floats_of(q >> 4, 0.0f, hi);
        return;
    case Q5_0:
        five_bits(bytes16(b + 6), b + 2, 16.0f, lo, hi);
        return;
    case Q5_1:
        five_bits(bytes16(b + 8), b + 4, 0.0f, lo, hi);
        return;
    case Q8_0:   /* the int8 q read as a byte: q + 128 = byte ^ 0x80 */
        floats_of(bytes16(b + 2) ^ 0x80, 128.0f, lo), floats_of(bytes16(b + 18) ^ 0x80, 128.0f, hi);
        return;
    case Q4_K: {   /* qs[128] at 16: sub-block s the low (even s) or high nibbles of 32 bytes */
        const uint8_t *qs = b + 16 + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        floats_of((bytes16(qs) >> shift) & 15, 0.0f, lo), floats_of((bytes16(qs + 16) >> shift) & 15, 0.0f, hi);
        return;
    }
    case Q5_K: {   /* qh[32] at 16 (bit s of byte j: element j's fifth bit), qs[128] at 48 */
        const uint8_t *qs = b + 48 + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        floats_of(((bytes16(qs) >> shift) & 15) | (((bytes16(b + 16) >> s) & 1) << 4), 0.0f, lo);
        floats_of(((bytes16(qs + 16) >> shift) & 15) | (((bytes16(b + 32) >> s) & 1) << 4), 0.0f, hi);
        return;
    }
    default: {   /* Q6_K: ql[128], qh[64] at 128; unit s in half s / 4, its row s % 4 */
        const int h = s / 4, row = s % 4, shift = 4 * (row / 2);
        const uint8_t *ql = b + 64 * h + 32 * (row % 2), *qh = b + 128 + 32 * h;
        floats_of(((bytes16(ql) >> shift) & 15) | (((bytes16(qh) >> (2 * row)) & 3) << 4), 32.0f, lo);
        floats_of(((bytes16(ql + 16) >> shift) & 15) | (((bytes16(qh + 16) >> (2 * row)) & 3) << 4), 32.0f, hi);
    }
    }
}

static int type_size(int format) {
    switch (format) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    }
    return 0;
}

static int units(int format) {   /* units of 32 a block */
    return format == Q4_K || format == Q5_K || format == Q6_K ? 8 : 1;
}

/* unit s's 32 weights d * c + m, gguf's float32 values (d * c is exact where m is added) */
static inline void weights(int format, const uint8_t *block, const block_scales *sc, int s, vf lo[PARTS],
                           vf hi[PARTS]) {
    const int at = format == Q6_K ? 2 * s : format == Q4_K || format == Q5_K ? s : 0;
    const int at_hi = format == Q6_K ? at + 1 : at;
    const float m = format == Q6_K ? 0.0f : sc->m[at];
    codes(format, block, s, lo, hi);
    for (int p = 0; p < PARTS; p++) lo[p] = lo[p] * sc->d[at] + m, hi[p] = hi[p] * sc->d[at_hi] + m;
}

/* Formats whose weights have an offset m (the others' is 0; Q6_K's two halves differ only
   in their scales) */
#define OFFSET(FORMAT) ((FORMAT) == Q4_1 || (FORMAT) == Q5_1 || (FORMAT) == Q4_K || (FORMAT) == Q5_K)

/* One row of x times one weight row. A unit's weights d * c + m give d * (c . x) + m *
   sum(x) (sums[i]: x's sum over unit i), so a lone row's codes are never scaled: 1.8 times
   the speed of dequantizing them first (one CPU core). The same weights as gguf's, the sums
   in another order. FORMAT is a constant in every expansion, so decode's switch folds away. */
#define DOT(FORMAT)                                                                              \
static float dot_##FORMAT(const float *x, const float *sums, int64_t k, const uint8_t *row) {    \
    const int64_t per_block = units(FORMAT), blocks = k / (32 * per_block);                       \
    vf acc = {0};                                                                                 \
    float offsets = 0;                                                                            \
    for (int64_t b = 0; b < blocks; b++) {                                                        \
        const uint8_t *block = row + b * type_size(FORMAT);                                       \
        block_scales sc;                                                                          \
        scales(FORMAT, block, &sc);                                                               \
        _Pragma("GCC unroll 8")   /* constant shifts in each unit's codes */                      \
        for (int s = 0; s < per_block; s++) {                                                     \
            const int64_t i = b * per_block + s;                                                  \
            const int unit_scale = FORMAT == Q4_K || FORMAT == Q5_K ? s : 0;                      \
            const float *xs = x + 32 * i;                                                         \
            vf lo[PARTS], hi[PARTS];                                                              \
            codes(FORMAT, block, s, lo, hi);                                                      \
            for (int p = 0; p < PARTS; p++) {                                                     \
                const vf x0 = vload(xs + VW * p), x1 = vload(xs + 16 + VW * p);                   \
                if (FORMAT == Q6_K)                                                               \
                    acc += lo[p] * x0 * sc.d[2 * s] + hi[p] * x1 * sc.d[2 * s + 1];               \
                else                                                                              \
                    acc += (lo[p] * x0 + hi[p] * x1) * sc.d[unit_scale];                          \
            }                                                                                     \
            if (OFFSET(FORMAT)) offsets += sc.m[unit_scale] * sums[i];                            \
        }                                                                                         \
    }                                                                                             \
    return vtotal(acc) + offsets;                                                                  \
}

/* out[r * n_out + w] for XT rows of x and WT weight rows (row_bytes apart) from row: each
   unit's weights are dequantized once into registers (gguf's values) for all XT rows, and
   every x load serves the WT weight rows. */
#define DOT_TILE(FORMAT, WT, XT)                                                                 \
static void tile_##FORMAT##_##WT##_##XT(const float *x, int64_t k, const uint8_t *row, int64_t row_bytes, \
                                        float *out, int64_t n_out) {                             \
    const int64_t per_block = units(FORMAT), blocks = k / (32 * per_block);                       \
    vf acc[WT][XT];                                                                               \
    for (int w = 0; w < WT; w++)                                                                  \
        for (int r = 0; r < XT; r++) acc[w][r] = (vf){0};                                         \
    for (int64_t b = 0; b < blocks; b++) {                                                        \
        block_scales sc[WT];                                                                      \
        for (int w = 0; w < WT; w++) scales(FORMAT, row + w * row_bytes + b * type_size(FORMAT), &sc[w]); \
        _Pragma("GCC unroll 8")                                                                   \
        for (int s = 0; s < per_block; s++) {                                                     \
            const float *xs = x + 32 * (b * per_block + s);                                       \
            vf lo[WT][PARTS], hi[WT][PARTS];                                                      \
            for (int w = 0; w < WT; w++)                                                          \
                weights(FORMAT, row + w * row_bytes + b * type_size(FORMAT), &sc[w], s, lo[w], hi[w]); \
            for (int r = 0; r < XT; r++)                                                          \
                for (int p = 0; p < PARTS; p++) {                                                 \
                    const vf x0 = vload(xs + r * k + VW * p), x1 = vload(xs + r * k + 16 + VW * p); \
                    for (int w = 0; w < WT; w++) {                                                \
                        acc[w][r] += lo[w][p] * x0;                                               \
                        acc[w][r] += hi[w][p] * x1;                                               \
                    }                                                                             \
                }                                                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int w = 0; w < WT; w++)                                                                  \
        for (int r = 0; r < XT; r++) out[r * n_out + w] = vtotal(acc[w][r]);                      \
}

/* x [rows, k] times the weight [n, k] (rows of row_bytes) transposed, into out [rows, n]:
   pairs of output features split over the threads, tiles of two weight rows by eight, four
   or two rows of x (the default model's matrices at 32 rows: 50 ms, against 78 a weight row
   at a time and 56 for float32 weights through torch's BLAS; a 4 x 4 tile took 60, 1 x 16
   67, 2 x 12 63), and a last odd row of x by dot_*. (A prefetch past the matrix's end is
   harmless: prefetches never fault.) */
#define TILES(FORMAT, WT) DOT_TILE(FORMAT, WT, 8) DOT_TILE(FORMAT, WT, 4) DOT_TILE(FORMAT, WT, 2)
#define RUN_TILES(FORMAT, WT)                                                                     \
    for (; r + 8 <= rows; r += 8) tile_##FORMAT##_##WT##_8(x + r * k, k, row, row_bytes, out + r * n + i, n); \
    for (; r + 4 <= rows; r += 4) tile_##FORMAT##_##WT##_4(x + r * k, k, row, row_bytes, out + r * n + i, n); \
    for (; r + 2 <= rows; r += 2) tile_##FORMAT##_##WT##_2(x + r * k, k, row, row_bytes, out + r * n + i, n);
#define LINEAR(FORMAT)                                                                           \
DOT(FORMAT)                                                                                       \
TILES(FORMAT, 2)                                                                                  \
TILES(FORMAT, 1)                                                                                  \
static void linear_##FORMAT(const float *x, const float *sums, int64_t rows, int64_t k,          \
                            const uint8_t *w, int64_t n, int64_t row_bytes, float *out, int threads) { \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
    for (int64_t pair = 0; pair < (n + 1) / 2; pair++) {                                          \
        const int64_t i = 2 * pair, count = i + 2 <= n ? 2 : 1;                                   \
        const uint8_t *row = w + i * row_bytes;                                                   \
        for (int64_t c = 0; c < count * row_bytes; c += 64) __builtin_prefetch(row + PREFETCH + c); \
        int64_t r = 0;                                                                            \
        if (count == 2) {                                                                         \
            RUN_TILES(FORMAT, 2)                                                                  \
        } else {                                                                                  \
            RUN_TILES(FORMAT, 1)                                                                  \
        }                                                                                         \
        for (; r < rows; r++)   /* the last row, when rows is odd */                           \
            for (int64_t j = 0; j < count; j++)                                                   \
                out[r * n + i + j] = dot_##FORMAT(x + r * k, sums, k, row + j * row_bytes);       \
    }                                                                                             \
}

LINEAR(Q4_0)
LINEAR(Q4_1)
LINEAR(Q5_0)
LINEAR(Q5_1)
LINEAR(Q8_0)
LINEAR(Q4_K)
LINEAR(Q5_K)
LINEAR(Q6_K)

/* 0; -1 for a format this file does not decode, -2 if out of memory */
int tokenspeed_block_linear(int format, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                            int64_t n, int64_t row_bytes, float *out, int threads) {
    if (!type_size(format)) return -1;
    /* the sums over each unit of the row no tile takes (the last, when rows is odd), for dot_* */
    float *sums = malloc(sizeof(float) * (size_t)(k / 32 + 1));
    if (!sums) return -2;
    for (int64_t i = 0; rows % 2 && i < k / 32; i++) {
        float s = 0;
        for (int j = 0; j < 32; j++) s += x[(rows - 1) * k + i * 32 + j];
        sums[i] = s;
    }
    switch (format) {
    case Q4_0: linear_Q4_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q4_1: linear_Q4_1(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q5_0: linear_Q5_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q5_1: linear_Q5_1(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q8_0: linear_Q8_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q4_K: linear_Q4_K(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q5_K: linear_Q5_K(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q6_K: linear_Q6_K(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    }
    free(sums);
    return 0;
}

/* the weight [n, k] as float32 into out, bit for bit gguf's: for products of many rows (a
   prompt), which a BLAS computes faster from float32 than the loops above from blocks */
int tokenspeed_block_dequantize(int format, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                                float *out, int threads) {
    const int size = type_size(format), per_block = units(format);
    if (!size) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b = 0; b < k / (32 * per_block); b++) {
            const uint8_t *block = w + i * row_bytes + b * size;
            block_scales sc;
            scales(format, block, &sc);
            #pragma GCC unroll 8
            for (int s = 0; s < per_block; s++) {
                vf lo[PARTS], hi[PARTS];
                weights(format, block, &sc, s, lo, hi);
                memcpy(out + i * k + 32 * (b * per_block + s), lo, sizeof lo);
                memcpy(out + i * k + 32 * (b * per_block + s) + 16, hi, sizeof hi);
            }
        }
    }
    return 0;
}

/* The input a layer's product reads, made here rather than by a few torch ops before the
   call (each some 10-15 us on the 2-core CPU, cold after a product's weights passed
   through the caches): a norm of x (+ residual) or a gated activation. */

/* normed = weight * (t * rsqrt(mean(t * t) + eps)) for t = x (+ residual), Hugging Face's
   float32 RMSNorm, t into total_out when there is a residual */
int tokenspeed_block_norm_linear(int format, const float *x, const float *residual, const float *norm_weight,
                                 float eps, int64_t rows, int64_t k, const uint8_t *w, int64_t n, int64_t row_bytes,
                                 float *normed, float *total_out, float *out, int threads) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        float *t = residual ? total_out + r * k : normed + r * k;
        if (residual)
            for (int64_t j = 0; j < k; j++) t[j] = xr[j] + residual[r * k + j];
        else
            memcpy(t, xr, sizeof(float) * (size_t)k);
        float squares = 0;
        for (int64_t j = 0; j < k; j++) squares += t[j] * t[j];
        const float inv = 1.0f / sqrtf(squares / (float)k + eps);
        for (int64_t j = 0; j < k; j++) normed[r * k + j] = norm_weight[j] * (t[j] * inv);
    }
    return tokenspeed_block_linear(format, normed, rows, k, w, n, row_bytes, out, threads);
}

/* act = silu(gate) * up for gate_up [rows, 2k] (gate, then up), silu(g) = g / (1 + exp(-g)) */
int tokenspeed_block_gated_linear(int format, const float *gate_up, int64_t rows, int64_t k, const uint8_t *w,
                                  int64_t n, int64_t row_bytes, float *act, float *out, int threads) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * k, *up = gate + k;
        float *a = act + r * k;
        #pragma omp simd
        for (int64_t j = 0; j < k; j++) a[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
    return tokenspeed_block_linear(format, act, rows, k, w, n, row_bytes, out, threads);
}
