// The row kernel for GGUF IQ4_NL weights kept in the file's blocks (fp16 d | qs[16], the
// nibbles indexes into a table of 16 int8 levels: quant_gguf_iq4nl.h).  It serves the
// weights the tiled kernel does not take (rows not a multiple of 16, builds without
// AVX-512 VNNI, PAGEDSERVE_CPU_GGUF_REPACK=0); repacked weights run the tiled kernel of
// quant_gguf_packed.cpp, whose entry for IQ4_NL is Q4_0's.
//
// The activations are the int8 blocks of 32 every GGUF kernel takes (quant_gguf.cpp
// quantizes them once per call, as llama.cpp's q8_0 blocks: IQ4_NL's vec_dot type): per
// block, y += (d_w * d_x) * sum(level(q) * x_q), as ggml_vec_dot_iq4_nl_q8_0.  A block's
// 32 nibbles become their levels with one vpshufb per 16; the product then is Q8_0's: the
// levels' signs moved into the activations (vpsignb) and |level| (<= 127) the unsigned
// operand of vpdpbusd (AVX-512 VNNI) or vpmaddubsw + vpmaddwd (AVX2; pair sums <= 2 *
// 127 * 127 < 2^15, no saturation).  Otherwise a scalar loop with the same integers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_gguf_common.h"

using pagedserve_gguf::half_to_float;
using pagedserve_gguf::row_kernel_gemm;
#if defined(__AVX2__)
using pagedserve_gguf::dot_u8s8;
using pagedserve_gguf::hsum;
#endif

#include "quant_gguf_iq4nl.h"

namespace {

constexpr int QK = 32;
using pagedserve_iq4nl::kBlockBytes;

struct XRow {
  const int8_t* q;  // [K]
  const float* d;   // [K / 32]
};

// Dot products of one weight row (nb blocks) with MB activation rows.
template <int MB>
void row_dot(const uint8_t* w, int64_t nb, const XRow* xr, float* out) {
#if defined(__AVX2__)
  const __m256i levels = pagedserve_iq4nl::levels_s8_256();
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBlockBytes;
    const float dw = half_to_float(blk);
    const __m256i wq = pagedserve_iq4nl::nibble_levels(blk + 2, levels);
    const __m256i wabs = _mm256_sign_epi8(wq, wq);
    for (int m = 0; m < MB; ++m) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[m].q + b * QK));
      const __m256i dot = dot_u8s8(wabs, _mm256_sign_epi8(xq, wq));
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xr[m].d[b]), _mm256_cvtepi32_ps(dot), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]);
#else
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBlockBytes;
    const float dw = half_to_float(blk);
    int8_t q[QK];
    for (int i = 0; i < 16; ++i) {
      q[i] = pagedserve_iq4nl::kValues[blk[2 + i] & 0x0F];
      q[i + 16] = pagedserve_iq4nl::kValues[blk[2 + i] >> 4];
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = xr[m].q + b * QK;
      int dot = 0;
      for (int i = 0; i < QK; ++i) dot += q[i] * xq[i];
      out[m] += dw * xr[m].d[b] * static_cast<float>(dot);
    }
  }
#endif
}

}  // namespace

// y float32 [M, N] = the int8 activation blocks (xq [M, K], scales xd [M, K/32]) times the
// IQ4_NL weight rows w [N, K/32 * 18] (the file's blocks).
void gguf_iq4nl_row_gemm(const int8_t* xq, const float* xd, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                         float* y) {
  const int64_t nb = K / QK, row_bytes = nb * kBlockBytes;
  // Weight rows across threads; each thread reads its rows once per 8 activation rows.
  row_kernel_gemm<XRow>(
      M, N, w, row_bytes, y, [&](int64_t m) { return XRow{xq + m * K, xd + m * nb}; },
      [&](auto mb, const uint8_t* wr, const XRow* xr, float* out) {
        row_dot<decltype(mb)::value>(wr, nb, xr, out);
      });
}
