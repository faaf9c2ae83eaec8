/* What a paged KV cache's scattered blocks cost to read, apart from any compute: one
 * thread reads a 256 MiB buffer as chunks of C bytes in random order, M chunks at a time
 * interleaved line by line (M concurrent streams), optionally with a software prefetch
 * (PREFETCHT1, into L2) of every line LEAD lines ahead.  C = 2 KiB is one kv head's rows
 * of a 16-token block at head size 64 in bf16; the last chunk size is close to a plain
 * sequential read.  Process CPU time, median of 5 passes.
 *     cc -O2 -mavx512f benchmarks/kv_read_pattern.c -o /tmp/kv_read_pattern && /tmp/kv_read_pattern [LEAD]
 * prints "chunk_bytes streams GB/s" lines. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const size_t n_bytes = (size_t)256 << 20, n_lines = n_bytes / 64;
  const long lead = argc > 1 ? atol(argv[1]) : 0;
  char* buf = aligned_alloc(1 << 21, n_bytes);
  const char** lines = malloc(n_lines * sizeof *lines);
  size_t* perm = malloc(n_bytes / 2048 * sizeof *perm);
  if (!buf || !lines || !perm) return 1;
  memset(buf, 1, n_bytes);
  unsigned long long rng = 88172645463325252ull;
  __m512i acc = _mm512_setzero_si512();
  const size_t chunks[] = {2048, 4096, 8192, 16384, 65536, 1 << 20};
  const int streams[] = {1, 2, 4, 8};
  for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ++ci)
    for (size_t si = 0; si < sizeof streams / sizeof *streams; ++si) {
      const size_t c = chunks[ci], nc = n_bytes / c, m = (size_t)streams[si];
      for (size_t i = 0; i < nc; ++i) perm[i] = i;
      for (size_t i = nc - 1; i > 0; --i) {  /* Fisher-Yates, xorshift64 */
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        const size_t j = rng % (i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
      }
      size_t n = 0;
      for (size_t g = 0; g + m <= nc; g += m)
        for (size_t off = 0; off < c; off += 64)
          for (size_t k = 0; k < m; ++k) lines[n++] = buf + perm[g + k] * c + off;
      double t[5];
      for (int s = 0; s < 5; ++s) {
        const double t0 = cpu_s();
        for (size_t i = 0; i < n; ++i) {
          if (lead && i + lead < n) _mm_prefetch(lines[i + lead], _MM_HINT_T1);
          acc = _mm512_add_epi32(acc, _mm512_load_si512(lines[i]));
        }
        t[s] = cpu_s() - t0;
      }
      qsort(t, 5, sizeof *t, cmp_double);
      printf("%7zu %d %5.1f\n", c, (int)m, n * 64 / t[2] / 1e9);
      fflush(stdout);
    }
  return _mm512_reduce_add_epi32(acc) == 42;
}
