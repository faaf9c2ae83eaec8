/* Peak VDPBF16PS throughput of one core: NA independent accumulators (registers only,
 * no memory operands), timed in thread CPU time.  Each instruction is 16 lanes x 2
 * products + 2 adds = 64 FLOP.  Built and run by benchmarks/bf16_gemm.py --peak:
 *     cc -O2 -mavx512f -mavx512bw -mavx512bf16 vdpbf16ps_peak.c -o peak && ./peak
 * prints "accumulators GFLOP/s" lines. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define BENCH(NA)                                                                      \
  static float run_##NA(long iters) {                                                \
    __m512 acc[NA];                                                                  \
    for (int i = 0; i < NA; ++i) acc[i] = _mm512_set1_ps(i * 1e-3f);                 \
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);                            \
    __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f81);                            \
    for (long it = 0; it < iters; ++it) {                                            \
      _Pragma("GCC unroll 32") for (int i = 0; i < NA; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b); \
      __asm__ volatile("" : "+v"(a));                                                \
    }                                                                                \
    __m512 s = acc[0];                                                               \
    for (int i = 1; i < NA; ++i) s = _mm512_add_ps(s, acc[i]);                       \
    return _mm512_reduce_add_ps(s);                                                  \
  }                                                                                  \
  static void bench_##NA(void) {                                                     \
    const long iters = 160000000L / NA;                                              \
    double best = 1e9;                                                               \
    float sink = 0;                                                                  \
    for (int rep = 0; rep < 5; ++rep) {                                              \
      double t = cpu_s();                                                            \
      sink += run_##NA(iters);                                                       \
      t = cpu_s() - t;                                                               \
      if (t < best) best = t;                                                        \
    }                                                                                \
    printf("%d %.1f %g\n", NA, (double)iters * NA * 64 / best * 1e-9, (double)sink * 0); \
  }

BENCH(4)
BENCH(8)
BENCH(12)
BENCH(16)
BENCH(24)

int main(void) {
  bench_4();
  bench_8();
  bench_12();
  bench_16();
  bench_24();
  return 0;
}
