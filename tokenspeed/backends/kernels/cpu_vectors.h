/* What the CPU's C kernels (cpu_blocks.c, cpu_attention.c) share: GCC's vector types, the
   width they compute at, a vector's load, the sum of its lanes, and glibc's vector expf.
   c_library hashes this file into each library's name, so a change here builds both anew. */

#ifndef TOKENSPEED_CPU_VECTORS_H
#define TOKENSPEED_CPU_VECTORS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* glibc's vector expf (libmvec), which math.h declares only under -ffast-math: a vector's
   lanes' exponentials at once (16 with AVX-512, 8 with AVX2) where a loop asks for them
   (#pragma omp simd) */
float expf(float) __attribute__((simd("notinbranch")));

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* The float vector the kernels compute on: 16 lanes with AVX-512, else 8. GCC keeps a
   vector wider than the machine's registers in memory: built for AVX2, 16-lane kernels
   stored each scalar's broadcast lane by lane and spilled their sums, and ran the default
   model's block products three times slower (at 32 rows four times) than 8 lanes. */
#if defined(__AVX512F__)
#define VW 16
typedef v16f vf;
typedef int32_t vi __attribute__((vector_size(64)));
#else
#define VW 8
typedef v8f vf;
typedef int32_t vi __attribute__((vector_size(32)));
#endif

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the lanes' sum as a tree, the halves added as vectors (a chain of scalar additions a key
   of decode attention took 5 times as long; splitting by memcpy ran Q8_0 products at 18 G
   weights/s against 31); a compiler without __builtin_shufflevector (GCC before 12) adds
   the lanes one by one */
static inline float vtotal(vf v) {
#if defined(__clang__) || __GNUC__ >= 12
#if VW == 16
    const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const v8f a = v;
#endif
    const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float s = 0;
    for (int j = 0; j < VW; j++) s += v[j];
    return s;
#endif
}

#endif
