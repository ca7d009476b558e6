/* What the CPU's C kernels (cpu_blocks.c, cpu_attention.c) share: GCC's vector types, a
   vector's load, the sum of its lanes, and glibc's vector expf. c_library hashes this
   file into each library's name, so a change here builds both anew. */

#ifndef TOKENSPEED_CPU_VECTORS_H
#define TOKENSPEED_CPU_VECTORS_H

#include <math.h>
#include <string.h>

/* glibc's vector expf (libmvec), which math.h declares only under -ffast-math: 16 lanes'
   exponentials at once where a loop asks for them (#pragma omp simd) */
float expf(float) __attribute__((simd("notinbranch")));

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline v16f floats16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the lanes' sum as a tree, the halves added as vectors (a chain of 16 scalar additions a
   key of decode attention took 5 times as long; splitting by memcpy ran Q8_0 products at
   18 G weights/s against 31); a compiler without __builtin_shufflevector (GCC before 12)
   adds the lanes one by one */
static inline float total(v16f v) {
#if defined(__clang__) || __GNUC__ >= 12
    const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float s = 0;
    for (int j = 0; j < 16; j++) s += v[j];
    return s;
#endif
}

#endif
