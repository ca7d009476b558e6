/* Decode attention on the CPU over a float32 paged cache, with its rotary and cache
   write in the same call (cpu_attention.py builds and loads this file).

   In torch a decode row's attention gathers its request's keys and values into new
   tensors (an index_select each) before one scaled_dot_product_attention call: at 16 rows
   of the default model that copied 3.5 MB a layer. Here each (row, KV head) pair reads its
   keys in place, page by page through the block table, for all the query heads that
   share the KV head, with the softmax computed online in float32 (a running maximum and
   sum, rescaled as a larger score comes), 64 keys at a time. The pairs are split over
   the threads (OpenMP, torch's own runtime).

   Shapes: q [rows, heads, dim]; k, v [slots, kv_heads, dim] (one layer's, slot = page *
   page_size + offset); block_tables [requests, table_width] int32; row_request,
   positions [rows] int64; out [rows, heads, dim]. Row r attends to the keys at positions
   max(0, positions[r] - window + 1) (0 without a window) to positions[r]. */

#include <stdint.h>

#include "cpu_vectors.h"

#define MAX_GROUP 16   /* query heads a KV head serves */
#define MAX_DIM 256
#define KEY_TILE 64

static inline float dot(const float *a, const float *b, int64_t dim) {
    vf acc = {0};
    for (int64_t d = 0; d < dim; d += VW) acc += vload(a + d) * vload(b + d);
    return vtotal(acc);
}

/* out[g] (the group's query heads) for one row and KV head */
static void attend(const float *q, int64_t group, int64_t dim, const float *k, const float *v, int64_t kv_heads,
                   const int32_t *table, int64_t page_size, int64_t first, int64_t last, float scale,
                   float *out) {
    const int64_t stride = kv_heads * dim;   /* between slots */
    float acc[MAX_GROUP][MAX_DIM], top[MAX_GROUP], sum[MAX_GROUP], p[MAX_GROUP][KEY_TILE];
    const float *keys[KEY_TILE];
    for (int64_t g = 0; g < group; g++) {
        top[g] = -INFINITY, sum[g] = 0;
        memset(acc[g], 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t start = first; start <= last; start += KEY_TILE) {
        const int64_t count = last - start + 1 < KEY_TILE ? last - start + 1 : KEY_TILE;
        for (int64_t j = 0; j < count; j++) {
            const int64_t key = start + j;
            keys[j] = k + ((int64_t)table[key / page_size] * page_size + key % page_size) * stride;
        }
        for (int64_t g = 0; g < group; g++) {
            float tile_top = -INFINITY;
            for (int64_t j = 0; j < count; j++) {
                p[g][j] = dot(q + g * dim, keys[j], dim) * scale;
                tile_top = p[g][j] > tile_top ? p[g][j] : tile_top;
            }
            const float new_top = tile_top > top[g] ? tile_top : top[g];
            const float rescale = expf(top[g] - new_top);   /* 0 on the first tile */
            sum[g] *= rescale;
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= rescale;
            #pragma omp simd
            for (int64_t j = 0; j < count; j++) p[g][j] = expf(p[g][j] - new_top);
            for (int64_t j = 0; j < count; j++) sum[g] += p[g][j];
            top[g] = new_top;
        }
        for (int64_t j = 0; j < count; j++) {
            const float *value = v + (keys[j] - k);
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < dim; d += VW) {
                    vf a = vload(acc[g] + d) + vload(value + d) * p[g][j];
                    memcpy(acc[g] + d, &a, sizeof a);
                }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] / sum[g];
}

/* the first position a row at last attends to: its window's start, else 0 */
static inline int64_t first_key(int64_t last, int64_t window) {
    return window && last - window + 1 > 0 ? last - window + 1 : 0;
}

static int fits(int64_t heads, int64_t kv_heads, int64_t dim) {
    return dim % 16 == 0 && dim <= MAX_DIM && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP;
}

static void attend_rows(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                        const float *k, const float *v, const int32_t *block_tables, int64_t table_width,
                        const int64_t *row_request, const int64_t *positions, int64_t page_size, int64_t window,
                        float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
        const int64_t r = pair / kv_heads, h = pair % kv_heads, last = positions[r], first = first_key(last, window);
        attend(q + (r * heads + h * group) * dim, group, dim, k + h * dim, v + h * dim, kv_heads,
               block_tables + row_request[r] * table_width, page_size, first, last, scale,
               out + (r * heads + h * group) * dim);
    }
}

/* The cache's bounds the rows must keep: requests (block-table rows), pages, slots (pages
   * page_size), and positions the rotary table holds (0: no rotation). */
typedef struct {
    int64_t table_rows, pages, positions;
} bounds;

/* 0, or -3 if a row's request, position or page lies outside the tables and the cache:
   the C reads and writes as it is told, where torch's indexing would raise */
static int rows_fit(int64_t rows, const int64_t *row_request, const int64_t *positions, const int32_t *block_tables,
                    int64_t table_width, int64_t page_size, int64_t window, bounds limits) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t last = positions[r], first = first_key(last, window);
        if (row_request[r] < 0 || row_request[r] >= limits.table_rows || last < 0 ||
            last >= table_width * page_size || (limits.positions && last >= limits.positions))
            return -3;
        const int32_t *table = block_tables + row_request[r] * table_width;
        for (int64_t p = first / page_size; p <= last / page_size; p++)
            if (table[p] < 0 || table[p] >= limits.pages) return -3;
    }
    return 0;
}

/* 0; -1 for shapes this file does not take (dim not a multiple of 16 or over MAX_DIM, a
   group over MAX_GROUP), -3 for rows outside the tables (rows_fit) */
int tokenspeed_decode_attention(const float *q, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                                const float *k, const float *v, const int32_t *block_tables, int64_t table_rows,
                                int64_t table_width, const int64_t *row_request, const int64_t *positions,
                                int64_t page_size, int64_t pages, int64_t window, float scale, float *out,
                                int threads) {
    if (!fits(heads, kv_heads, dim)) return -1;
    const bounds limits = {table_rows, pages, 0};
    if (rows_fit(rows, row_request, positions, block_tables, table_width, page_size, window, limits)) return -3;
    attend_rows(q, rows, heads, kv_heads, dim, k, v, block_tables, table_width, row_request, positions, page_size,
                window, scale, out, threads);
    return 0;
}

/* heads rows of x rotated by one position's table row (its cos, then its sin, dim / 2 of
   each) into out: Hugging Face's x * cos + rotate_half(x) * sin, each product rounded
   apart as torch computes it (no fused multiply-add), so bit for bit the reference's */
__attribute__((optimize("fp-contract=off")))
static void rotate(const float *x, int64_t heads, int64_t dim, const float *cos_sin, float *out) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
    const int64_t half = dim / 2;
    const float *cos = cos_sin, *sin = cos_sin + half;
    for (int64_t h = 0; h < heads; h++, x += dim, out += dim)
        for (int64_t j = 0; j < half; j++) {
            const float a = x[j], b = x[j + half];
            out[j] = a * cos[j] - b * sin[j];
            out[j + half] = b * cos[j] + a * sin[j];
        }
}

/* Each row's queries and keys rotated by its position (cos_sin [table_positions, dim]),
   its key and value written at its slot (slot_mapping [rows]), then every row's
   attention, as tokenspeed_decode_attention. q, k and v are [rows, heads or kv_heads,
   dim] with rows q_stride, k_stride, v_stride apart; q_rot [rows, heads, dim] is scratch.
   -3 for rows outside the tables, the cache or the rotary table. */
int tokenspeed_rope_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                     const float *v, int64_t v_stride, int64_t rows, int64_t heads,
                                     int64_t kv_heads, int64_t dim, const float *cos_sin, int64_t table_positions,
                                     const int64_t *positions, const int64_t *slot_mapping, float *k_cache,
                                     float *v_cache, const int32_t *block_tables, int64_t table_rows,
                                     int64_t table_width, const int64_t *row_request, int64_t page_size,
                                     int64_t pages, int64_t window, float scale, float *q_rot, float *out,
                                     int threads) {
    if (!fits(heads, kv_heads, dim)) return -1;
    const bounds limits = {table_rows, pages, table_positions};
    if (rows_fit(rows, row_request, positions, block_tables, table_width, page_size, window, limits)) return -3;
    for (int64_t r = 0; r < rows; r++)
        if (slot_mapping[r] < 0 || slot_mapping[r] >= pages * page_size) return -3;
    const int64_t slot_size = kv_heads * dim;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *table_row = cos_sin + positions[r] * dim;
        rotate(q + r * q_stride, heads, dim, table_row, q_rot + r * heads * dim);
        rotate(k + r * k_stride, kv_heads, dim, table_row, k_cache + slot_mapping[r] * slot_size);
        memcpy(v_cache + slot_mapping[r] * slot_size, v + r * v_stride, sizeof(float) * (size_t)slot_size);
    }
    attend_rows(q_rot, rows, heads, kv_heads, dim, k_cache, v_cache, block_tables, table_width, row_request,
                positions, page_size, window, scale, out, threads);
    return 0;
}
