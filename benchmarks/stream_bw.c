/* Memory bandwidth as the decode GEMMs see it: a read-only pass (sum of 64-byte vector
 * loads, what streaming weights costs) and a STREAM-style copy (b[i] = a[i], counted as
 * read plus write bytes) over buffers well beyond the last-level cache, on 1..T OpenMP
 * threads (each thread its own contiguous slice), best of several passes in wall time.
 *     cc -O2 -mavx512f -fopenmp benchmarks/stream_bw.c -o /tmp/stream_bw && /tmp/stream_bw [MiB]
 * prints "threads read_GB/s copy_GB/s" lines. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Sum of the floats of [p, p + n) (n a multiple of 64), four independent vector sums. */
static float read_sum(const float* p, size_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(p + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(p + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(p + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 256;
  const size_t n = mib * (1u << 20) / sizeof(float);
  float* a = aligned_alloc(64, n * sizeof(float));
  float* b = aligned_alloc(64, n * sizeof(float));
  if (!a || !b) return 1;
  for (size_t i = 0; i < n; ++i) a[i] = (float)(i & 1023) * 1e-3f;
  memset(b, 0, n * sizeof(float));
  const int max_threads = omp_get_max_threads();
  volatile float sink = 0;
  for (int t = 1; t <= max_threads; ++t) {
    double best_read = 1e9, best_copy = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      float sums[64] = {0};
      double t0 = now_s();
#pragma omp parallel num_threads(t)
      {
        const int id = omp_get_thread_num();
        const size_t chunk = n / t / 64 * 64;
        sums[id] = read_sum(a + id * chunk, chunk);
      }
      double t1 = now_s();
#pragma omp parallel num_threads(t)
      {
        const int id = omp_get_thread_num();
        const size_t chunk = n / t / 64 * 64;
        float* dst = b + id * chunk;
        const float* src = a + id * chunk;
        for (size_t i = 0; i < chunk; ++i) dst[i] = src[i];
      }
      double t2 = now_s();
      for (int i = 0; i < t; ++i) sink += sums[i];
      if (t1 - t0 < best_read) best_read = t1 - t0;
      if (t2 - t1 < best_copy) best_copy = t2 - t1;
    }
    const double bytes = (double)(n / t / 64 * 64) * t * sizeof(float);
    printf("%d %.1f %.1f\n", t, bytes / best_read * 1e-9, 2 * bytes / best_copy * 1e-9);
  }
  return sink == 12345.f;
}
