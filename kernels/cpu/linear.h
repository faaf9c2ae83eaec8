// Skinny bf16 linear for decode: y[M, N] = x[M, K] . w[N, K]^T (+ bias) with M small.
//
// A decode step multiplies a handful of activation rows by every weight of the model, so
// it is bound by reading the weights once from memory.  General GEMM libraries pack
// and block for large M and, for a few rows, spend more time on that than on the
// weights.  Here each tile of 4 weight rows is read straight from its [N, K] rows
// (VDPBF16PS takes bf16 pairs as they are stored: no conversion, no packing) and is
// multiplied with up to 4 activation rows at once; further row blocks reuse it from L1.
// Products of two bf16 values are exact in float32, so the result differs from a
// float32-accumulating reference only by summation order and the final rounding.
#pragma once

#include <algorithm>

#include "kernels.h"
#include "vec.h"

#if defined(PAGEDSERVE_HAVE_AVX512BF16)
namespace pagedserve_cpu {

struct SkinnyLinearBf16 {
  static constexpr int kTileN = 4, kTileM = 4;

  // 32 bf16 values from p; the last chunk of a row (rem < 32 values) zero-fills.
  static __m512i load32(const BF16* p, int64_t rem) {
    if (rem >= 32) return _mm512_loadu_si512(p);
    return _mm512_maskz_loadu_epi16(__mmask32((1ull << rem) - 1), p);
  }

  // Output rows [m0, m0 + MB) x columns [n0, n0 + nb), nb <= kTileN.
  template <int MB>
  static void tile(const LinearArgs& a, int64_t m0, int64_t n0, int nb) {
    const BF16* x = static_cast<const BF16*>(a.x);
    const BF16* w = static_cast<const BF16*>(a.w);
    const BF16* wr[kTileN];
    for (int j = 0; j < kTileN; ++j) wr[j] = w + (n0 + std::min(j, nb - 1)) * a.w_stride;  // repeats past nb
    const BF16* xr[MB];
    for (int i = 0; i < MB; ++i) xr[i] = x + (m0 + i) * a.x_stride;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < a.k; k += 32) {
      const int64_t rem = a.k - k;
      __m512i wv[kTileN];
#pragma GCC unroll 4
      for (int j = 0; j < kTileN; ++j) wv[j] = load32(wr[j] + k, rem);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = (__m512bh)load32(xr[i] + k, rem);
#pragma GCC unroll 4
        for (int j = 0; j < kTileN; ++j) acc[i * kTileN + j] = _mm512_dpbf16_ps(acc[i * kTileN + j], xv, (__m512bh)wv[j]);
      }
    }
    alignas(64) float s[16];
    _mm512_store_ps(s, Avx512::reduce_tree(acc));  // lane t = sum of acc[t]
    const BF16* bias = static_cast<const BF16*>(a.bias);
    BF16* out = static_cast<BF16*>(a.out);
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < nb; ++j) {
        const float v = s[i * kTileN + j] + (bias ? to_float(bias[n0 + j]) : 0.f);
        out[(m0 + i) * a.out_stride + n0 + j] = from_float<BF16>(v);
      }
  }

  // Columns [n_begin, n_end) of every output row.
  static void run(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
      const int nb = int(std::min<int64_t>(kTileN, n_end - n0));
      for (int64_t m0 = 0; m0 < a.m; m0 += kTileM) {
        switch (std::min<int64_t>(kTileM, a.m - m0)) {
          case 1: tile<1>(a, m0, n0, nb); break;
          case 2: tile<2>(a, m0, n0, nb); break;
          case 3: tile<3>(a, m0, n0, nb); break;
          default: tile<4>(a, m0, n0, nb); break;
        }
      }
    }
  }
};

}  // namespace pagedserve_cpu
#endif
